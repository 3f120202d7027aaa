"""The engine's memory: one manager (manager.py) over the paged KV pool, the window pool, the
recurrent-state slots and their snapshots, and the host prefix store. The scheduler asks it for
pages as vLLM v1's scheduler asks its KVCacheManager; each step's copies come back as one
MemoryPlan (plan.py) that the executor carries out around the step."""
