"""Deprecated alias of paxcli.models.knobs (see paxcli.families)."""
from paxcli.families import alias

alias(__name__, 'paxcli.models.knobs')
