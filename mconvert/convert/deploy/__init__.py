"""The deployment formats, one module each: FasterTransformer (`fastertransformer`, `ft_checks`), TensorRT-LLM
(`trtllm`, `trtllm_layout`), GGUF (`gguf`) and ONNX (`onnx`)."""
