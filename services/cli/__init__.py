"""The `castor` command line, one module per part: `main` (the parser; serve, demo, db), `client` (the
connection and the shared API client, driven synchronously), `render` (rich tables, colours, progress,
formatting), the operator commands per group (`jobs`, `watch`, `failures`, `checkpoints`, dispatched by
`ops`) and `simulate`. Importing the package stays cheap (`castor --help` loads no httpx, no torch).
"""

from services.cli.main import _split_launch_command, admin_token_notice, build_parser, main

__all__ = ["_split_launch_command", "admin_token_notice", "build_parser", "main"]
