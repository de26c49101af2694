"""Deprecated alias of paxcli.models.classifier_experiment (see paxcli.families)."""
from paxcli.families import alias

alias(__name__, 'paxcli.models.classifier_experiment')
