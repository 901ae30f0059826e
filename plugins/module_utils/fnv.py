"""placeholder"""
BASIS = 0xCBF29CE484222325
