"""Scripts the bench's peers run in their own virtual environments (`bench/peers.py`): each
imports only its engine and the standard library, never tinyvllm."""
