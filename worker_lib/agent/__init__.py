"""The worker agent (`castor agent`): one per machine. `agent.Agent` runs it; `services.MachineServices`
is what the embedded mode shares with it. Submodules are imported on demand: `python -m
worker_lib.agent.warm` must not import the agent."""
