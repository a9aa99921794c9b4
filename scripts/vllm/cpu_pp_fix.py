"""Works around vLLM 0.32's CPU pipeline parallelism in eager mode, for pd_check --prefill-pp.

A worker of a later PP stage reads the previous stage's activations into buffers it allocates on
its first dummy forward (GPUModelRunner._dummy_run). vLLM's CPU worker skips that forward when it
runs eagerly with an explicit KV cache size (CPUWorker._should_warm_up_model), so the first real
step fails (`assert self.intermediate_tensors is not None` in sync_and_gather_intermediate_tensors),
with or without a KV connector. Loaded in each worker process as its worker extension
(`worker_extension_cls="cpu_pp_fix.Extension"`: vLLM imports it there), it allocates the buffers on
first use, as the dummy forward would have.
"""

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

_sync = GPUModelRunner.sync_and_gather_intermediate_tensors


def _sync_allocating(self, num_tokens, intermediate_tensors, sync_self):
    if self.intermediate_tensors is None:
        self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
            batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)
    return _sync(self, num_tokens, intermediate_tensors, sync_self)


GPUModelRunner.sync_and_gather_intermediate_tensors = _sync_allocating


class Extension:
    """Nothing of its own: importing this module is the fix."""
