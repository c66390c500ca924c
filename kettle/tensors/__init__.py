"""The bottom of the model stack: checkpoint tensors (`weights`), the paged KV cache (`kv_cache`) and the
tensor-parallel process group (`distributed`), which every layer and model may use and which import none."""
