"""The deployment formats, one module each, each with its `prepare(spec, options)`: FasterTransformer
(`fastertransformer`), TensorRT-LLM (`trtllm`, `trtllm_layout`), GGUF (`gguf`) and ONNX (`onnx`)."""
