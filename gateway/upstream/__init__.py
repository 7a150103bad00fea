"""Links to the services upstream of the gateway: the tokenizer and the scheduler, and how their errors surface."""
