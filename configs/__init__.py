"""Experiment configs: ``get_config(arg)`` files for ``experiments/train.py --config``.

See ``configs/base.py`` for the fields and the arg syntax.
"""
