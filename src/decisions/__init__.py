"""Typed decisions on the engine side: how a decision call becomes token ids (render.py). The question
form both HTTP routes share is contract/decisions.py; the request kind is tasks/decide.py."""
