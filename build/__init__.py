"""Build: sources, recipes' weight layout, the phase pipeline, its journal, ranks."""
