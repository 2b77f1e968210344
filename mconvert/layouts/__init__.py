"""Every format's on-disk layout from shapes alone, without torch: Megatron's parallel split and rank files
(`megatron`), FasterTransformer's and TensorRT-LLM's files (`ft`, `trtllm`), and what a conversion writes and
needs (`plan` for a checkpoint on disk, `estimate` for a preset). `plan` and `--dry-run` run from here."""
