"""The one exception base every room derives its own error type from.

The CLI turns any ``AgentloadError`` into a single readable line and exit status 2;
anything else escaping a command is a bug and keeps its traceback.
"""

from __future__ import annotations


class AgentloadError(Exception):
    """Bad input or an environment problem the user can fix; printed as one line."""
