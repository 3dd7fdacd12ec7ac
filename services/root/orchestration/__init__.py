"""The leader's background work (see loop): leadership, failure detection and the recovery driver."""

from services.root.orchestration.leadership import Deposed
from services.root.orchestration.loop import Orchestrator

__all__ = ["Deposed", "Orchestrator"]
