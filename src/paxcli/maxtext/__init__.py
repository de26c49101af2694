"""MaxText run scripts to paxcli experiments: read the script, translate, write a recipe.

`shell` reads a run script as text (never runs it); `defaults` holds MaxText's dated
base.yml defaults, scaling eras, model presets and lookup tables; `translate` turns the
trainer's overrides into LmExperiment knobs; `recipe` writes the experiment file.
"""
