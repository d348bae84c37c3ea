"""Interfaces between the engine and the models it trains."""
