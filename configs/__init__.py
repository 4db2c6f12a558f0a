"""Model configurations (ml-collections). `base.get_config()` lists every key; the other modules
(`tiny`, `demo`, `kimi_linear_48b_a3b`) override some of them. Load one with
`model.config.load_config(["tiny", "key=value", ...])`; a name's dashes map to underscores."""
