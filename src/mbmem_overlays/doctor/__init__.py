"""The OOM doctor: parse job logs (parse.py), diagnose (diagnose.py), render (render.py).

Never imports torch or Megatron Bridge.
"""
