"""Engine integrations: kvferry loaded by an inference engine through its own plug-in seam.

* :mod:`kvferry.integrations.vllm` — ``KvferryConnector``, a vLLM v1 KV connector for
  disaggregated prefill/decode (``kv_connector_module_path="kvferry.integrations.vllm"``).
* :mod:`kvferry.integrations.vllm_offload` — ``KvferryOffloadingConnector`` /
  ``KvferryOffloadingSpec``, kvferry's host and file tier as vLLM's KV offloading backend; its
  manager (:mod:`~kvferry.integrations.offload_manager`, pure Python) and worker
  (:mod:`~kvferry.integrations.offload_worker`, torch) import without vLLM.

Each module imports its engine only when imported itself: ``import kvferry`` never needs vLLM.
"""
