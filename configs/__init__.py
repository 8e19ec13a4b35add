"""Experiment configs: each file's get_config(arg) returns an ml_collections ConfigDict."""
