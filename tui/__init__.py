"""agentload.tui: the Textual dashboard, live and over a recorded run.

Not built yet; until it is, replays show a live status line (TTY) or progress lines.
"""
