"""The worker's context limit and the model's rotary table come from one place, dummy models included."""

from __future__ import annotations

from gpu_worker_svc.model.dummy import dummy_config
from gpu_worker_svc.model.loader import MAX_ROTARY_POSITIONS, load_model, rotary_positions
from gpu_worker_svc.model.parallel import TPGroup


def test_a_dummy_models_rotary_table_covers_the_context_the_worker_admits():
    cfg = dummy_config("dummy:smollm2-135m")
    model = load_model("dummy:smollm2-135m", TPGroup())
    # The worker refuses requests past rotary_positions(cfg); a shorter table would crash a step instead.
    assert model.model.rotary.cos.shape[0] == rotary_positions(cfg) == cfg.max_position_embeddings
    assert rotary_positions(cfg, 512) == 512
    assert rotary_positions(dummy_config("dummy:llama-3.2-1b")) == MAX_ROTARY_POSITIONS
