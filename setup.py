"""Build hook placeholder: the native op library build is added here."""
from setuptools import setup

setup()
