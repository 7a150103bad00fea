"""The CPU weight formats a worker takes, by name: what its settings check before torch loads.

"int8", "fp16" and "int4" are layers/quantize.py's quantizations; "gguf", a .gguf file's own
Q4_0/Q4_1/Q8_0 blocks, which model/gguf_weights.py reads from the file (its bytes, not a float
weight, are the input); "none", the model's dtype (a .gguf file dequantized: the parity
reference); and "auto", the default (model/weight_format.py: gguf for a .gguf model on CPU,
otherwise none).
"""

CPU_WEIGHT_FORMATS = ["auto", "none", "fp16", "gguf", "int4", "int8"]
