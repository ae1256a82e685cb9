"""What a person sees: the comparison of a model's runs, sample grids, notebook controls."""
