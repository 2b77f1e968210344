"""Validators: logits of every format compared on the same tokens (`validate`), vLLM readiness (`verify`)."""
