"""The decode loop the project owns (gpt-fast's shape): one static KV cache, compiled steps, draft proposers and token choice."""
