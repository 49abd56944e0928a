"""Model weights as files, read tensor by tensor without a whole copy: safetensors folders (`folder`) and single
files as the community ships them, ComfyUI's fp8-scaled and int8 ones too (`single_file`), GGUF files (`gguf_file`,
`gguf_quants`); and LoRA files in ComfyUI's key form (`comfy`). Formats, not families: the Model Spec's loader
(vt.shared.models.components) picks the reader a component's source needs, a family gives its key table."""
