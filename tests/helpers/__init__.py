"""What several test modules share, by job: one place to import from
(``from tests.helpers.waiting import wait_until``), instead of one test module importing
another. Not test modules: pytest collects nothing here.
"""
