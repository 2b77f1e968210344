"""The HuggingFace side: the safetensors directory source and writer (`source`) and the tokenizer files
(`tokenizer`)."""
