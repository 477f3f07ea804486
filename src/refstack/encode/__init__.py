"""Images in chat requests and the encode stage (``refstack serve --disagg epd``).

``encoder`` (the seeded vision encoder), ``images`` (``data:`` URLs decoded and checked),
``mm`` (placeholders, embeddings, the encoder cache), ``inline`` (the single engine's
encode on its own thread), ``worker`` / ``frontend`` / ``handoff`` (encode workers, the
EPD front end, embeddings through the KV store).
"""
