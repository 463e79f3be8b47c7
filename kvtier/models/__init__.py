"""Model decoders, configs and loading. `DEFAULT_MODEL` lives here so that the CLI can name it without
importing torch."""

DEFAULT_MODEL = "smollm2-135m"
