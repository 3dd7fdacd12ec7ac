"""Page contexts: typed, ready-to-draw views of what the repository reads, one dataclass per page and one
module per page: `jobs` (the list), `job` (one job), `failure` (one failure), and `common` (what the job
and failure pages share). Every name is re-exported here, as the routes use them (`contexts.job_page`).

The routes stay thin (authenticate, read, render); the templates only format and draw what is here.
"""

from services.root.web.contexts.common import *  # noqa: F403
from services.root.web.contexts.common import __all__ as _common
from services.root.web.contexts.failure import *  # noqa: F403
from services.root.web.contexts.failure import __all__ as _failure
from services.root.web.contexts.job import *  # noqa: F403
from services.root.web.contexts.job import __all__ as _job
from services.root.web.contexts.jobs import *  # noqa: F403
from services.root.web.contexts.jobs import __all__ as _jobs

__all__ = [*_common, *_jobs, *_job, *_failure]
