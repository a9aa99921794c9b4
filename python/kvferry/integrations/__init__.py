"""Engine integrations: kvferry loaded by an inference engine through its own plug-in seam.

* :mod:`kvferry.integrations.vllm` — ``KvferryConnector``, a vLLM v1 KV connector for
  disaggregated prefill/decode (``kv_connector_module_path="kvferry.integrations.vllm"``).

Each module imports its engine only when imported itself: ``import kvferry`` never needs vLLM.
"""
