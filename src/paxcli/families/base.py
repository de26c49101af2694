"""Deprecated alias of paxcli.models.training (see paxcli.families)."""
from paxcli.families import alias

alias(__name__, 'paxcli.models.training')
