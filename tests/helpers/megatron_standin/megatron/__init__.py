"""Stand-in for Megatron-LM's `megatron` package: just what transformers' megatron_gpt2 script imports.

transformers 4.57.6 `models/megatron_gpt2/checkpoint_reshaping_and_interoperability.py` (HF -> Megatron) does
`from megatron.core import package_info` and, for versions >= 0.6.0,
`from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding`. Pass this directory's parent
(`tests/helpers/megatron_standin`) as its `--megatron-path`; being a regular package it shadows an installed
megatron-core inside that script's process only. Used by tests/convert/megatron/test_external_hf_script.py and `make bench`.
"""
