"""What the Explorer keeps: the recorder and its journal, privacy (redaction at record time,
consent) and feedback on recorded answers.
"""
