"""The end of a step: gradient buffers, their reduction over replicas (plain, ZeRO-1, PowerSGD), precision."""
