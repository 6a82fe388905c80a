"""What tfmp decided for each model, kept with the model; see docs/architecture.md."""
