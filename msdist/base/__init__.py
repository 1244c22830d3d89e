"""The leaves every layer may use; nothing here imports from the rest of msdist.

User-facing errors (errors), atomic file writes (files), the wrapper of every command-line main
(cli) and who this process is in its job (launch_env: environment variables only).
"""
