"""Model weights as files, read tensor by tensor without a whole copy: safetensors folders (`folder`) and single
files as the community ships them, ComfyUI's fp8-scaled ones too (`single_file`). Formats, not families: the
Model Spec's loader (vt.shared.models.components) picks the reader a component's source needs."""
