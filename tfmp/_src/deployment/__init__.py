"""Deployment: a float32 copy of a trained model and checked SavedModel/TFLite export."""
