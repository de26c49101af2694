"""Deprecated alias of paxcli.models.lm_experiment (see paxcli.families)."""
from paxcli.families import alias

alias(__name__, 'paxcli.models.lm_experiment')
