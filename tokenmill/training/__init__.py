"""Offline training of what the engine serves with: Medusa heads (`tokenmill train-medusa`)."""
