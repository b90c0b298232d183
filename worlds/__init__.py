"""The worlds recast.py trains in: the toy world (toyworld.py and its model in toy_model/), the
diffusers world (diffusersworld.py) with one small part per model family (sd3world.py,
fluxworld.py, flux2world.py, qwenimageworld.py), the lookup that picks a part (families.py), and
hub.py for models named by a hub id. This file imports nothing: the toy path never loads the
diffusers world. Nothing here imports recast.py or the run plumbing, or ends the process.
"""
