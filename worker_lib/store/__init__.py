"""The shared-memory checkpoint store: slots (`slots`), manifests (`manifest`), the state's structure
(`tree`), tensor placement (`layout`), the striped copy engine (`copy`), verification (`integrity`).

Internal to worker_lib: the training process reaches it through `worker_lib.Checkpointer`, the worker agent
uses `slots.SlotStore`, `manifest.Manifest` and `integrity.verify` directly to replicate slots. Import the
submodules: only `copy` (and what uses it) needs torch.
"""
