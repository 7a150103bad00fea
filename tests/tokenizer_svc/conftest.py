"""The service is tested on the tokenizers the library's tests load: the same session fixtures."""

from tests.shardline.core.text.conftest import corpus, hf_tokenizer, model_path, spm_gguf, spm_tokenizer, tokenizer

__all__ = ["corpus", "hf_tokenizer", "model_path", "spm_gguf", "spm_tokenizer", "tokenizer"]
