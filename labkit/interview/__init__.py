"""Interview rehearsal: the topics list shipped with labkit, estimates and checked questions.

* ``topics.md``     the interview topics with ids (S1-S8, A1-A4, K1-K12, P1-P3), copied from the
                    project's notes so that a fresh clone has it.
* ``topics.py``     its parser.
* ``estimates.py``  the back-of-envelope numbers an answer needs, as plain functions built on
                    labkit's models (memory, alpha-beta, ResNet/GPT counts, Young/Daly).
* ``quiz.py``       2-4 questions per id; every expected answer is computed by labkit code.
"""
