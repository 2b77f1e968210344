"""The deployment formats, one module each, each with its `prepare(spec, options)`: FasterTransformer
(`fastertransformer`), TensorRT-LLM (`trtllm`), GGUF (`gguf`) and ONNX (`onnx`). FasterTransformer's and
TensorRT-LLM's layouts and `prepare` import no torch: they are `layouts/ft.py` and `layouts/trtllm.py`."""
