"""``python -m agentload`` runs the same CLI as the ``agentload`` console script."""

from agentload.cli import main

main()
