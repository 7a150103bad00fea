"""Stop strings over text that arrives in pieces."""

from gateway.output.stop_strings import StopMatcher


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    sent, stopped = [], False
    for n, piece in enumerate(pieces):
        text, stopped = matcher.feed(piece, final=n == len(pieces) - 1)
        sent.append(text)
        if stopped:
            break
    return sent, stopped


def test_a_stop_split_over_pieces_is_cut_and_never_half_sent() -> None:
    sent, stopped = feed_all(StopMatcher(["STOP"]), ["Hello S", "T", "OP and more"])
    assert stopped
    assert sent == ["Hello ", "", ""]


def test_a_false_start_is_released_when_the_next_piece_rules_it_out() -> None:
    sent, stopped = feed_all(StopMatcher(["STOP"]), ["go ST", "ART now"])
    assert not stopped
    assert sent == ["go ", "START now"]


def test_the_earliest_of_several_stops_wins() -> None:
    sent, stopped = feed_all(StopMatcher(["world", "lo w"]), ["hello world"])
    assert stopped and sent == ["hel"]


def test_final_flushes_held_text_and_no_stops_passes_everything() -> None:
    matcher = StopMatcher(["\n\n"])
    assert matcher.feed("line\n") == ("line", False)
    assert matcher.feed("", final=True) == ("\n", False)
    assert StopMatcher([]).feed("any text") == ("any text", False)


def test_a_stop_at_the_very_start() -> None:
    assert StopMatcher(["<"]).feed("<tag>") == ("", True)


def test_unarmed_feeds_pass_whole_stops_but_hold_partial_ones() -> None:
    matcher = StopMatcher(["world"])
    assert matcher.feed("hello world, wor", armed=False) == ("hello world, ", False)  # "wor" may become a stop
    assert matcher.feed("ld!", armed=True) == ("", True)  # completed once armed: cut


def test_the_stop_complete_first_wins_and_its_end_is_reported() -> None:
    # Checked token by token, "cd" is complete before "abcdef" is: the text is cut where "cd" starts.
    matcher = StopMatcher(["abcdef", "cd"])
    assert matcher.feed("xy", final=False) == ("xy", False)
    assert matcher.feed("abcdefgh") == ("ab", True)
    assert matcher.match_end == 4  # in "abcdefgh": just past "cd"
    held = StopMatcher(["STOP"])
    assert held.feed("go ST") == ("go ", False)
    assert held.feed("OP now") == ("", True)
    assert held.match_end == 2  # the stop began in text held back from the previous piece


def test_of_stops_one_token_completes_the_first_listed_wins_as_in_vllm() -> None:
    # " brown" completes both: vLLM takes the first of the list that it finds.
    for stops, sent in ((["brown", "row"], " The quick "), (["row", "brown"], " The quick b")):
        matcher = StopMatcher(stops)
        assert matcher.feed(" The quick", one_token=True) == (" The quick", False)
        assert matcher.feed(" brown", one_token=True) == (sent[len(" The quick") :], True), stops
    # Over a piece of several tokens the one complete first wins, whatever the list's order.
    assert StopMatcher(["brown", "row"]).feed(" The quick brown") == (" The quick b", True)
