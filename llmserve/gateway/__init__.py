"""The gateway: the OpenAI API in front of replicas, with keys, limits, routing and fallback."""
