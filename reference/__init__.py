"""The reference engine: runs the spec's stages as a program people use."""
